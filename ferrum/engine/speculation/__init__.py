"""N-gram speculation: guesses of a request's next tokens, verified in the same decode.

    speculator.py  when to guess and how many, per request and per step (`Speculator`)
    ngram.py       where guesses come from: the request's own tokens, recent answers
    pricing.py     what a guessed position costs and how likely it is kept
"""
