"""WhiteNoise's table of static files, built once per test process instead of once per client.

Every Django test client builds its own middleware chain on its first request, and WhiteNoise's
middleware lists and stats every static file the finders know (``WHITENOISE_USE_FINDERS``) when
it is built: about 40 ms on the 2-core CI machine, paid by every test that makes a client, a
third of a management-API permission test. The files do not change while the tests run, so the
table is built once per set of settings that shape it and handed to each new middleware. What a
request gets is unchanged: the same files, the same headers (``tests/test_fast_static.py``).
"""

from __future__ import annotations

from typing import Any

# The settings that decide which files WhiteNoise lists and with which headers, besides its own
# WHITENOISE_* ones (DEBUG sets its defaults).
SHAPING = ("DEBUG", "STATIC_URL", "FORCE_SCRIPT_NAME", "STATIC_ROOT", "STATICFILES_DIRS",
           "STATICFILES_FINDERS", "STORAGES", "INSTALLED_APPS")


def _key() -> str:
    from django.conf import settings

    names = [*SHAPING, *sorted(n for n in dir(settings) if n.startswith("WHITENOISE_"))]
    return repr([(name, getattr(settings, name, None)) for name in names])


def install() -> Any:
    """Make WhiteNoise's middleware reuse the finders' files; returns the function that undoes
    it."""
    from whitenoise.middleware import WhiteNoiseMiddleware

    real = WhiteNoiseMiddleware.add_files_from_finders
    tables: dict[str, dict[str, Any]] = {}

    def add_files_from_finders(self: Any) -> None:
        key = _key()
        if key not in tables:
            before = dict(self.files)
            real(self)
            # What the finders added or replaced (they win over STATIC_ROOT's, as in real()).
            tables[key] = {url: f for url, f in self.files.items() if before.get(url) is not f}
            return
        self.files.update(tables[key])

    WhiteNoiseMiddleware.add_files_from_finders = add_files_from_finders  # type: ignore[method-assign]

    def undo() -> None:
        WhiteNoiseMiddleware.add_files_from_finders = real  # type: ignore[method-assign]

    return undo
