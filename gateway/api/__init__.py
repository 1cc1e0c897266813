"""Management REST API: tenants, keys, members, quotas, usage, reports, pools and models."""
