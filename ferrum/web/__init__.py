"""The browser pages ferrum serves itself: a chat at `/` and a live view of the engine at
`/dashboard`.

Plain HTML, CSS and JavaScript of ferrum's own in `static/` (no build step, nothing fetched
from elsewhere: the pages work offline), read once when the app is made. The pages hold no
data: anyone may load them, and every figure they show comes from the API routes, which ask
for the API key as any client's request does (the page asks the user for it on a 401 and
keeps it in the browser).

    static/common.js     the API key, fetch with it, the key box
    static/markdown.js   Markdown to DOM nodes, text only (model output never becomes HTML)
    static/chat.js       the chat: models, streaming, conversations in localStorage
    static/plot.js       line and stacked-area charts on a canvas
    static/dashboard.js  /metrics and /slots polled, per-model charts and the slots table
"""

from ferrum.web.pages import add_pages, is_page, page_answer, read_static

__all__ = ["add_pages", "is_page", "page_answer", "read_static"]
