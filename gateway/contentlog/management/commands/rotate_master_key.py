"""Re-wrap every tenant DEK under the newest CONTENT_LOG_MASTER_KEYS entry (records untouched).

Rotation: prepend ``newkid:<base64>`` to CONTENT_LOG_MASTER_KEYS everywhere, run this, then drop
the old entry once no backup you must restore still holds keys wrapped by it.
``--generate KID`` prints a fresh entry to prepend.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from gateway.contentlog import crypto, keys


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--generate", metavar="KID", help="print a new key entry and exit")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["generate"]:
            self.stdout.write(crypto.generate_master_key_entry(options["generate"]))
            return
        count = keys.rewrap_all()
        self.stdout.write(f"re-wrapped {count} data keys under {crypto.current_master().kid}")
