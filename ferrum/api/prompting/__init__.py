"""What every dialect's generation shares between its body and the engine: the chat
template (`chat_template.py`, `builtin_templates.py`), tools (`tool_request.py`, the calls'
formats and parsing in `tool_calls.py`), grammars and what a schema may cost (`grammar.py`,
`schema_limits.py`), and the thread that prepares requests in turns with the engines
(`preparation.py`)."""
