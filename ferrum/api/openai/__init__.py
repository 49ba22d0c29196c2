"""The OpenAI dialect: `dialect.py`, its error shape and the translation of its generation
bodies for a cluster's routing."""
