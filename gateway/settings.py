"""Settings, all from the environment (see README "Settings").

Bad values stop start-up with a message naming the variable (``gateway.env``).
Defaults give the embedded mode: SQLite file, embedded Redis, simulated engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import dj_database_url
import django_stubs_ext

from gateway.env import (
    ImproperSetting,
    env_bool,
    env_cidrs,
    env_float,
    env_int,
    env_list,
    env_peppers,
    env_ports,
    env_proxy_ssl_header,
    env_str,
    require_production_secrets,
)

# Django's ModelForm, ModelAdmin... are generic in the type stubs only: this makes ModelForm[M]
# valid at run time too, so modules can name the model they hold (mypy --strict asks for it).
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("GATEWAY_VAR_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DEBUG", False)
# Production (DEBUG off, or GATEWAY_REQUIRE_SECRETS on) refuses the development secrets below
# and a missing content-log master key, naming the variable (gateway.secrets_check). The
# embedded quick start (scripts/run.sh) runs with DEBUG on and keeps its development defaults.
REQUIRE_SECRETS = not DEBUG or env_bool("GATEWAY_REQUIRE_SECRETS", False)
_DEV_SECRET = "insecure-dev-secret-key-change-me-0123456789abcdef"
_DEV_PEPPER = "dev-pepper-change-me-0123456789"
SECRET_KEY = env_str("SECRET_KEY", _DEV_SECRET)
if len(SECRET_KEY) < 32:
    raise ImproperSetting("SECRET_KEY must be at least 32 characters")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# API keys are stored as HMAC-SHA256(pepper, key). Versions let the pepper rotate.
API_KEY_PEPPERS = env_peppers("API_KEY_PEPPERS", {1: env_str("API_KEY_PEPPER", _DEV_PEPPER)})
API_KEY_PREFIX = env_str("API_KEY_PREFIX", "igw")
if not API_KEY_PREFIX.isalnum() or not API_KEY_PREFIX.islower() or len(API_KEY_PREFIX) > 8:
    raise ImproperSetting("API_KEY_PREFIX must be 1-8 lowercase letters or digits")
# Seconds a gateway process may trust a cached credential; revocation also broadcasts.
AUTH_CACHE_SECONDS = env_float("AUTH_CACHE_SECONDS", 1.0, minimum=0.0)
# While the database is down, a principal verified this recently is still honoured (same epoch).
AUTH_STALE_SECONDS = env_float("AUTH_STALE_SECONDS", 300.0, minimum=0.0)
# Prefix-cache salts are HMAC(tenant) under this secret so tenants never share KV blocks.
# Its own secret in production: SECRET_KEY may be shared with other Django tooling.
CACHE_SALT_SECRET = env_str("CACHE_SALT_SECRET", "" if REQUIRE_SECRETS else SECRET_KEY)

DEFAULT_REGION = env_str("DEFAULT_REGION", "local")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "catalog",
    "tenants",
    "metering",
    "metering.billing",
    "workers",
    "gateway.contentlog",
    "gateway.portal",
    "gateway.api",
]

MIDDLEWARE = [
    # First: REMOTE_ADDR and forwarded headers are decided before anything reads them.
    "infra.clientaddr.RealClientMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "gateway.dbguard.DatabaseUnavailableMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "gateway.portal.errors.FriendlyNotFoundMiddleware",  # no technical 404 page under DEBUG
]

ROOT_URLCONF = "gateway.urls"
ASGI_APPLICATION = "gateway.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASE_URL = env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'gateway.sqlite3'}")
try:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60)}
except Exception as exc:  # dj_database_url raises a bare ValueError/KeyError on junk
    raise ImproperSetting(f"DATABASE_URL={DATABASE_URL!r} is not a database URL: {exc}") from exc
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    Path(DATABASES["default"]["NAME"]).parent.mkdir(parents=True, exist_ok=True)
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"]["OPTIONS"] = {"timeout": 20}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Empty means "start or reuse the embedded Redis server under VAR_DIR" (infra.redis_conn).
REDIS_URL = env_str("REDIS_URL", "")
REDIS_KEY_PREFIX = env_str("REDIS_KEY_PREFIX", "igw")
# High availability (infra.redis_conn): "host:port,host:port" of Redis Sentinels and the name of
# the master they watch. Empty: REDIS_URL is the one Redis. Set: clients ask the sentinels where
# the master is (and again after a failover); REDIS_URL then supplies only db number and password.
REDIS_SENTINELS = env_str("REDIS_SENTINELS", "")
REDIS_SENTINEL_MASTER = env_str("REDIS_SENTINEL_MASTER", "")
REDIS_SENTINEL_NODES: list[tuple[str, int]] = []
for _node in filter(None, (n.strip() for n in REDIS_SENTINELS.split(","))):
    _host, _, _port = _node.rpartition(":")
    if not _host or not _port.isdigit() or not 0 < int(_port) < 65536:
        raise ImproperSetting(f"REDIS_SENTINELS: {_node!r} is not host:port")
    REDIS_SENTINEL_NODES.append((_host.strip("[]"), int(_port)))
if REDIS_SENTINEL_NODES and not REDIS_SENTINEL_MASTER:
    raise ImproperSetting("REDIS_SENTINEL_MASTER must name the master when REDIS_SENTINELS is set")
# Redis Cluster (infra.redis_conn, ADR 0018): "host:port,host:port" of some cluster nodes (the
# client learns the rest). Every key carries a hash tag, so each script and multi-key command
# stays in one slot. Celery's broker (CELERY_BROKER_URL) stays a plain Redis.
REDIS_CLUSTER = env_str("REDIS_CLUSTER_NODES", "")
REDIS_CLUSTER_NODES: list[tuple[str, int]] = []
for _node in filter(None, (n.strip() for n in REDIS_CLUSTER.split(","))):
    _host, _, _port = _node.rpartition(":")
    if not _host or not _port.isdigit() or not 0 < int(_port) < 65536:
        raise ImproperSetting(f"REDIS_CLUSTER_NODES: {_node!r} is not host:port")
    REDIS_CLUSTER_NODES.append((_host.strip("[]"), int(_port)))
if REDIS_CLUSTER_NODES and REDIS_SENTINEL_NODES:
    raise ImproperSetting("set REDIS_CLUSTER_NODES or REDIS_SENTINELS, not both")

# Cells (docs/adr/0019): a cell is the gateways, Redis and workers for a set of pools in one
# region, all sharing the one PostgreSQL. CELL names this process's cell ("" = cells off: one
# cell, every tenant served here). CELLS is JSON {"name": {"url": public base URL, "redis_url":
# the cell's Redis}}; a request for a tenant not served here is forwarded to its home cell's url,
# and the quota rebalancer reaches every cell's Redis through redis_url (redis+cluster://host:port
# when that cell runs Redis Cluster).
CELL = env_str("CELL", "")
try:
    CELLS: dict[str, dict[str, str]] = json.loads(env_str("CELLS", "{}"))
except ValueError as _exc:
    raise ImproperSetting(f"CELLS is not JSON: {_exc}") from None
if not isinstance(CELLS, dict) or not all(
        isinstance(c, dict) and {"url", "redis_url"} <= c.keys() for c in CELLS.values()):
    raise ImproperSetting('CELLS must map each cell name to {"url": ..., "redis_url": ...}')
if CELL and CELL not in CELLS:
    raise ImproperSetting(f"CELL={CELL!r} is not one of CELLS ({', '.join(CELLS) or 'none'})")
# The home of a tenant whose home_cell is blank.
DEFAULT_CELL = env_str("DEFAULT_CELL", "") or CELL or next(iter(CELLS), "")
# Each cell of a split tenant keeps at least CELL_SHARE_FLOOR / n of its quota; a cell whose
# Redis lost its share falls back to exactly that floor (serving.cells).
CELL_SHARE_FLOOR = env_float("CELL_SHARE_FLOOR", 0.1, minimum=0.0)
if CELL_SHARE_FLOOR > 1:
    raise ImproperSetting("CELL_SHARE_FLOOR must be between 0 and 1")
CELL_REBALANCE_SECONDS = env_float("CELL_REBALANCE_SECONDS", 10.0, minimum=1.0)
# Replicas that must acknowledge a share's shrink before another cell may grow (Redis WAIT), so
# a failover cannot bring back a larger share that was already handed to another cell.
CELL_SHARE_WAIT_REPLICAS = env_int("CELL_SHARE_WAIT_REPLICAS", 0, minimum=0)

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True
LOGIN_URL = "/portal/login/"
LOGIN_REDIRECT_URL = "/portal/"
LOGOUT_REDIRECT_URL = "/portal/login/"
# Mail (spend alerts): console by default; set EMAIL_BACKEND/EMAIL_HOST to send for real.
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "gateway@localhost")
# Where people reach the portal, for links in emails sent outside a request (spend alerts).
PUBLIC_BASE_URL = env_str("PUBLIC_BASE_URL", "http://127.0.0.1:8000").rstrip("/")
# Finance exports: files land here; ranges with more rollup rows than this run as a Celery task.
MEDIA_ROOT = VAR_DIR / "media"
EXPORT_INLINE_MAX_ROWS = env_int("EXPORT_INLINE_MAX_ROWS", 5000, minimum=1)

# Request bodies: the inference API accepts large prompts, but not unbounded ones.
MAX_REQUEST_BYTES = env_int("MAX_REQUEST_BYTES", 4 * 1024 * 1024, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BYTES
# The whole body must arrive within this many seconds of the headers (else 408), so a client
# that trickles its body cannot hold a connection and a task forever (gateway.inference.bodylimit).
BODY_READ_TIMEOUT_S = env_float("BODY_READ_TIMEOUT_S", 30.0, minimum=0.1)
# Each request's headers must arrive within this many seconds of connecting or of the previous
# response (slow-loris guard, gateway.httpproto).
HEADER_READ_TIMEOUT_S = env_float("HEADER_READ_TIMEOUT_S", 10.0, minimum=0.1)
# A comment line on a stream idle this long, so proxies and clients keep it open.
SSE_KEEPALIVE_SECONDS = env_float("SSE_KEEPALIVE_SECONDS", 15.0, minimum=0.05)
# Bearer token for GET /metrics; empty = only clients on this host may read it.
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
# Overload shedding (gateway.inference.overload): a pool is overloaded when more requests are
# queued than this factor times its running capacity (0: never shed); then tenants whose WFQ
# backlog exceeds this many cost units are refused with 503.
SHED_QUEUE_FACTOR = env_float("SHED_QUEUE_FACTOR", 4.0, minimum=0.0)
SHED_VIRTUAL_BACKLOG = env_float("SHED_VIRTUAL_BACKLOG", 100_000.0, minimum=0.0)
# The password bootstrap_demo gives the admin user it creates (empty: generate and print one).
GATEWAY_ADMIN_PASSWORD = env_str("GATEWAY_ADMIN_PASSWORD", "")

# Serving: the simulated engine's pool and heartbeat timing.
WORKER_HEARTBEAT_SECONDS = env_float("WORKER_HEARTBEAT_SECONDS", 1.0, minimum=0.05)
WORKER_DEAD_AFTER_SECONDS = env_float("WORKER_DEAD_AFTER_SECONDS", 5.0, minimum=0.2)
# Pool circuit breakers (serving/health.py): this many consecutive retryable failures before
# the first token open a pool's breaker; it stays open this long, then lets one probe through
# per probe window. A pool with no live worker is refused at once, whatever its breaker says.
BREAKER_FAILURES = env_int("BREAKER_FAILURES", 3, minimum=1)
BREAKER_COOLDOWN_SECONDS = env_float("BREAKER_COOLDOWN_SECONDS", 5.0, minimum=0.0)
BREAKER_PROBE_SECONDS = env_float("BREAKER_PROBE_SECONDS", 10.0, minimum=0.1)
# Routes (gateway/inference/routes.py): attempts on other targets after a retryable failure
# before the first token, unless the route sets its own count.
ROUTE_RETRIES = env_int("ROUTE_RETRIES", 2, minimum=0)
# The exact-match response cache (opt-in per tenant, key or request; docs/adr: the cache): an
# entry lives this long, a tenant holds at most this many, and a larger answer is not cached.
RESPONSE_CACHE_TTL_SECONDS = env_float("RESPONSE_CACHE_TTL_SECONDS", 300.0, minimum=1.0)
RESPONSE_CACHE_MAX_ENTRIES = env_int("RESPONSE_CACHE_MAX_ENTRIES", 1000, minimum=1)
RESPONSE_CACHE_MAX_ENTRY_BYTES = env_int("RESPONSE_CACHE_MAX_ENTRY_BYTES", 262_144, minimum=1024)
# manage.py serve looks at the pool table this often, and starts, stops or restarts the pool
# workers of pools added, disabled or changed meanwhile.
SERVE_POOL_POLL_SECONDS = env_float("SERVE_POOL_POLL_SECONDS", 1.0, minimum=0.1)
# Gateway liveness (serving.liveness): a dead gateway's unread requests are cancelled.
GATEWAY_HEARTBEAT_SECONDS = env_float("GATEWAY_HEARTBEAT_SECONDS", 1.0, minimum=0.05)
GATEWAY_DEAD_AFTER_SECONDS = env_float("GATEWAY_DEAD_AFTER_SECONDS", 10.0, minimum=0.2)
# Bounded shutdown (SIGTERM, Ctrl-C under manage.py serve): a pool worker finishes its running
# sequences for at most this long, then aborts the rest (retryable worker_shutdown); a gateway
# ends its open streams at once with a retryable error, and waits at most this long for
# responses still being written (uvicorn's --timeout-graceful-shutdown).
WORKER_DRAIN_SECONDS = env_float("WORKER_DRAIN_SECONDS", 30.0, minimum=0.0)
GATEWAY_SHUTDOWN_SECONDS = env_float("GATEWAY_SHUTDOWN_SECONDS", 5.0, minimum=0.0)
WFQ_INPUT_PRICE = env_float("WFQ_INPUT_PRICE", 1.0, minimum=0.0)
WFQ_OUTPUT_PRICE = env_float("WFQ_OUTPUT_PRICE", 2.0, minimum=0.0)
# KV memory held over time, per token of context per decode step (docs/adr/0017): 2 / 50,000
# makes a context of one slot's KV share in the design's pool (381,000 tokens / 8 slots, about
# 50,000) cost what a decode token costs, so a long context pays for the memory it holds.
WFQ_KV_PRICE = env_float("WFQ_KV_PRICE", 4e-5, minimum=0.0)
# Engine shares (rule E, serving/lua/wfq/dispatch.lua): a tenant's share of the prompt tokens
# a worker's engine prefills in this many seconds may wait there for prefill at once.
WFQ_PREFILL_HORIZON_SECONDS = env_float("WFQ_PREFILL_HORIZON_SECONDS", 1.0, minimum=0.0)
# Slot fairness (serving/lua/wfq/dispatch.lua, ADR 0006): a tenant that enqueued within this many
# seconds counts as active, so a worker keeps slots free for its next request; a tenant over its
# weighted share of a worker's slots may take one more only while this fraction of the slots
# (at most) stays free for the other active tenants' unused shares (0: plain work-conserving).
WFQ_ACTIVE_WINDOW_SECONDS = env_float("WFQ_ACTIVE_WINDOW_SECONDS", 5.0, minimum=0.0)
WFQ_SLOT_RESERVE = env_float("WFQ_SLOT_RESERVE", 0.5, minimum=0.0)
# The order the gateway enqueues in: "wfq" (production) or "fifo", the baseline the HTTP
# benchmarks measure in the same run (bench/http_fairness.py). A pool keeps the policy its
# queued requests were enqueued under until it drains (serving/wfq.py).
WFQ_POLICY = env_str("WFQ_POLICY", "wfq")
if WFQ_POLICY not in ("wfq", "fifo"):
    raise ImproperSetting(f"WFQ_POLICY must be 'wfq' or 'fifo', not {WFQ_POLICY!r}")

# Celery on Redis (docs/adr/0002). Generations never run as Celery tasks: a pool worker's engine
# host pulls them from the WFQ, which moves each id atomically into that worker's in-flight set,
# so no broker redelivery can re-run one. Celery carries only short, idempotent tasks (janitor,
# usage flush): acked on receipt, one at a time, never redelivered after a worker is lost.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "")  # empty: same as REDIS_URL
CELERY_TASK_ACKS_LATE = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_REJECT_ON_WORKER_LOST = False
CELERY_TASK_ACKS_ON_FAILURE_OR_TIMEOUT = True
# Only matters for late acks (none here); an hour keeps a stray late-ack task from reappearing
# while it still runs.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}
CELERY_TASK_TIME_LIMIT = 300
CELERY_TASK_SOFT_TIME_LIMIT = 240
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_WORKER_SEND_TASK_EVENTS = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)

REST_FRAMEWORK = {
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 100,
    # Management API (gateway.api): session or management token, errors shaped like OpenAI's.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "gateway.api.authentication.ManagementTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "gateway.api.errors.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Inference gateway management API",
    "DESCRIPTION": "Tenants, keys, members, quotas, usage, reports, pools and models.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",  # served locally: no CDN
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Offline docs: no validator badge fetched from swagger.io, system fonts instead of Google
    # Fonts (templates/drf_spectacular/redoc.html drops the font links).
    "SWAGGER_UI_SETTINGS": {"validatorUrl": None, "deepLinking": True,
                            "persistAuthorization": True},
    "REDOC_UI_SETTINGS": {"theme": {"typography": {
        "fontFamily": "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif",
        "headings": {"fontFamily": "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"},
        "code": {"fontFamily": "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace"},
    }}},
    "COMPONENT_SPLIT_REQUEST": True,
    # Error answers (400/401/403/404/...) listed on every operation: gateway/api/schema.py.
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "gateway.api.schema.add_error_responses"],
}

LOG_LEVEL = env_str("LOG_LEVEL", "INFO").upper()
if LOG_LEVEL not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
    raise ImproperSetting(f"LOG_LEVEL={LOG_LEVEL!r} is not a logging level")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    # A 401/403/404/405/429 is a refusal the API meant to give: one line, no traceback
    # (infra.quietlog). Django's own "django" handlers are replaced by the root's, so a request
    # is not logged twice (once by Django's console handler, once by the root's).
    "filters": {"expected_refusals": {"()": "infra.quietlog.ExpectedRefusals"},
                "require_debug_false": {"()": "django.utils.log.RequireDebugFalse"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"},
                 "mail_admins": {"level": "ERROR", "filters": ["require_debug_false"],
                                 "class": "django.utils.log.AdminEmailHandler"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    # Beat runs the janitor, usage flush and content-log drain every few seconds; one line per
    # task run would drown everything else at INFO.
    "loggers": {
        **{name: {"level": "WARNING"} for name in ("celery.app.trace", "celery.worker.strategy")},
        "django": {"handlers": ["mail_admins"], "level": "INFO", "propagate": True},
        "django.request": {"filters": ["expected_refusals"], "propagate": True},
    },
}

# --- Data protection and enterprise sign-in (docs/adr/0004) ------------------------------------
# Content log master keys, newest first: "kid2:<base64 32 bytes>,kid1:<...>" (or
# CONTENT_LOG_MASTER_KEYS_FILE). Empty: a development key generated under VAR_DIR, with a warning.
CONTENT_LOG_MASTER_KEYS = env_str("CONTENT_LOG_MASTER_KEYS", "")
CONTENT_LOG_MAX_RETENTION_DAYS = 30  # the policy's ceiling, not a knob
CONTENT_LOG_MAX_PENDING = env_int("CONTENT_LOG_MAX_PENDING", 100_000, minimum=1)
# The tenants' request log (metering.requestlog): how long entries are kept, and how many
# refusals may wait in Redis for the writer (the newest are kept).
REQUEST_LOG_RETENTION_DAYS = env_int("REQUEST_LOG_RETENTION_DAYS", 30, minimum=1)
REQUEST_LOG_MAX_PENDING = env_int("REQUEST_LOG_MAX_PENDING", 100_000, minimum=1)
# Fairness as an SLO (metering.fairness): the sliding window of the igw_fair_* gauges.
FAIRNESS_WINDOW_SECONDS = env_int("FAIRNESS_WINDOW_SECONDS", 60, minimum=5)
# Break-glass: self-approval (with an alert to ADMINS) only if explicitly allowed.
BREAKGLASS_SELF_APPROVAL = env_bool("BREAKGLASS_SELF_APPROVAL", False)
BREAKGLASS_MAX_MINUTES = env_int("BREAKGLASS_MAX_MINUTES", 8 * 60, minimum=1)
ADMINS = [("Platform", a) for a in env_list("ADMIN_EMAILS", [])]
# OIDC bearer tokens (tenants.oidc): clock skew allowed on exp/nbf, JWKS caching.
OIDC_LEEWAY_SECONDS = env_int("OIDC_LEEWAY_SECONDS", 30, minimum=0)
# Big prompts are tokenized in this many processes per gateway process (gateway.inference.
# tokenize_pool); a tenant whose prompts are refused for size this often in a minute gets 429s.
TOKENIZE_PROCESSES = env_int("TOKENIZE_PROCESSES", 2, minimum=1)
OVERSIZE_REFUSALS_PER_MINUTE = env_int("OVERSIZE_REFUSALS_PER_MINUTE", 10, minimum=1)
OIDC_JWKS_CACHE_SECONDS = env_int("OIDC_JWKS_CACHE_SECONDS", 300, minimum=1)
OIDC_JWKS_MIN_REFRESH_SECONDS = env_float("OIDC_JWKS_MIN_REFRESH_SECONDS", 30.0, minimum=0.0)
OIDC_HTTP_TIMEOUT_SECONDS = env_float("OIDC_HTTP_TIMEOUT_SECONDS", 3.0, minimum=0.1)
# Mutual TLS behind a TLS-terminating proxy (tenants.mtls): the certificate headers are read
# only from peers in TRUSTED_PROXY_CIDRS; from anyone else they are ignored.
# The same list decides whose X-Forwarded-For is believed (infra.clientaddr).
TRUSTED_PROXY_CIDRS = env_cidrs("TRUSTED_PROXY_CIDRS")
# The one header the trusted proxy writes the client address into: x-forwarded-for (nginx
# $proxy_add_x_forwarded_for, ALB, Envoy), forwarded (RFC 7239) or x-real-ip. Any other
# forwarded header is the client's own and is ignored (infra.clientaddr).
TRUSTED_PROXY_HEADER = env_str("TRUSTED_PROXY_HEADER", "x-forwarded-for").lower()
if TRUSTED_PROXY_HEADER not in ("x-forwarded-for", "forwarded", "x-real-ip"):
    raise ImproperSetting("TRUSTED_PROXY_HEADER must be x-forwarded-for, forwarded or "
                          "x-real-ip")
MTLS_CERT_HEADER = env_str("MTLS_CERT_HEADER", "X-SSL-Client-Cert")
MTLS_FINGERPRINT_HEADER = env_str("MTLS_FINGERPRINT_HEADER", "X-SSL-Client-Fingerprint")
# Portal SSO (gateway.sso, mozilla-django-oidc), configured per tenant on its IdentityProvider.
AUTHENTICATION_BACKENDS = [
    "django.contrib.auth.backends.ModelBackend",
    "gateway.sso.TenantOIDCBackend",
]
OIDC_AUTHENTICATION_CALLBACK_URL = "sso:callback"
OIDC_USE_PKCE = True
OIDC_TIMEOUT = OIDC_HTTP_TIMEOUT_SECONDS

# --- Tenant access: management tokens, invitations, sign-in throttling -----------------------
# Every management token expires: this many days unless its maker picks another lifetime, and
# never later than the maximum.
MANAGEMENT_TOKEN_DEFAULT_DAYS = env_int("MANAGEMENT_TOKEN_DEFAULT_DAYS", 90, minimum=1)
MANAGEMENT_TOKEN_MAX_DAYS = env_int("MANAGEMENT_TOKEN_MAX_DAYS", 365, minimum=1)
# An emailed invitation link works once, for this many days.
INVITATION_DAYS = env_int("INVITATION_DAYS", 7, minimum=1)
# Where EMAIL_BACKEND=django.core.mail.backends.filebased.EmailBackend writes messages.
EMAIL_FILE_PATH = env_str("EMAIL_FILE_PATH", str(VAR_DIR / "mail"))
# Sign-in throttling (django-axes) for the portal's and the admin's login forms: after
# SIGNIN_FAILURE_LIMIT failed attempts for one username from one address, that pair is refused
# (HTTP 429) for SIGNIN_COOLOFF_MINUTES. The address is the TCP peer, never a forwarded header.
INSTALLED_APPS += ["axes"]
MIDDLEWARE += ["axes.middleware.AxesMiddleware"]
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", *AUTHENTICATION_BACKENDS]
AXES_FAILURE_LIMIT = env_int("SIGNIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = env_float("SIGNIN_COOLOFF_MINUTES", 15.0, minimum=0.1) / 60  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_IPWARE_META_PRECEDENCE_ORDER = ("REMOTE_ADDR",)
AXES_LOCKOUT_CALLABLE = "gateway.portal.lockout.lockout_response"  # says how long to wait
AXES_VERBOSE = False

# --- Production secrets (refuse development values; see REQUIRE_SECRETS above) ---------------
if REQUIRE_SECRETS:
    require_production_secrets(
        secret_key=SECRET_KEY, dev_secret_key=_DEV_SECRET, peppers=API_KEY_PEPPERS,
        dev_pepper=_DEV_PEPPER, cache_salt_secret=CACHE_SALT_SECRET,
        content_log_master_keys=CONTENT_LOG_MASTER_KEYS,
    )

# --- HTTPS and cookies (``manage.py check --deploy`` is clean with DEBUG off) ------------------
# Each can be turned off for a deployment that serves plain http on purpose (the test suite's
# live processes); the defaults follow DEBUG. SECURE_PROXY_SSL_HEADER ("X-Forwarded-Proto:
# https") is believed only from TRUSTED_PROXY_CIDRS: infra.clientaddr strips forwarded headers
# from any other peer before Django reads them.
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31_536_000, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", not DEBUG)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", not DEBUG)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_HTTPONLY = True
SECURE_PROXY_SSL_HEADER = env_proxy_ssl_header(
    "SECURE_PROXY_SSL_HEADER", "X-Forwarded-Proto: https" if TRUSTED_PROXY_CIDRS else "")
# Health probes (load balancers, kubelets) speak plain http to the pod; /v1 and /metrics are
# Channels consumers that never pass Django's middleware (the TLS proxy owns http there).
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]

# --- Spend-alert webhooks (metering.billing.webhooks) --------------------------------------------
WEBHOOK_ALLOW_HTTP = env_bool("WEBHOOK_ALLOW_HTTP", False)  # development only
WEBHOOK_ALLOWED_CIDRS = env_cidrs("WEBHOOK_ALLOWED_CIDRS")  # private networks allowed anyway
WEBHOOK_ALLOWED_PORTS = env_ports("WEBHOOK_ALLOWED_PORTS", [443, 8443])
WEBHOOK_TIMEOUT_SECONDS = env_float("WEBHOOK_TIMEOUT_SECONDS", 3.0, minimum=0.1)
WEBHOOK_MAX_ATTEMPTS = env_int("WEBHOOK_MAX_ATTEMPTS", 5, minimum=1)
WEBHOOK_RETRY_BASE_SECONDS = env_float("WEBHOOK_RETRY_BASE_SECONDS", 30.0, minimum=0.0)
SPEND_ALERTS_MAX_PER_TENANT = env_int("SPEND_ALERTS_MAX_PER_TENANT", 20, minimum=1)
CELERY_TASK_ROUTES = {"billing.deliver_webhook": {"queue": "webhooks"}}
