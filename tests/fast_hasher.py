"""The password hasher tests use: PBKDF2 at one iteration.

The production hasher at its production cost would spend seconds per test on the users tests
make. One iteration of the same algorithm is fast, and its hashes name their iteration count,
so a gateway started as a subprocess (the production hasher list) still verifies them: a live
test can sign in as a user the test process made.
"""

from __future__ import annotations

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class FastPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    iterations = 1
