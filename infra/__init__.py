"""What every package stands on: where Redis is, its clients, and the leased queue.

Nothing here knows about tenants, requests or HTTP, so every other package may import it.
"""
