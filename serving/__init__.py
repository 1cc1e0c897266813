"""The serving core: admission, settlement, the WFQ dispatcher, the token transport, liveness,
the janitor and the submission wire format, each one atomic Redis script away from shared state.

See docs/architecture.md for what may import what.
"""
