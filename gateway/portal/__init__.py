"""Tenant self-service portal: keys, usage, quotas, content logging, playground, finance pages."""
