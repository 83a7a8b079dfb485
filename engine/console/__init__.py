"""The operations console: runs, live map progress, tables and failures in a browser.

`console_app(Console(...))` is the ASGI application the gateway mounts at `/ui`;
`open_console(dsn=..., bind=...)` serves it alone for every org, behind a one-time login link
(`runplane console`). See `routes` (HTTP), `login` (the login routes), `auth` (sessions),
`queries` (reads), `figures` (what each run did, from its run history), `rates` (rows/s),
`words` (the words shown for row states), `pages` (HTML).
"""

from .auth import CONSOLE_ACTIONS, Sessions, Viewer
from .routes import Console, console_app
from .serve import ConsoleServer, open_console

__all__ = ["CONSOLE_ACTIONS", "Console", "ConsoleServer", "Sessions", "Viewer", "console_app",
           "open_console"]
