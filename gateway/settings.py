"""Settings, all from the environment (see README "Settings").

Bad values stop start-up with a message naming the variable (``gateway.env``).
Defaults give the embedded mode: SQLite file, embedded Redis, simulated engine.
"""

from __future__ import annotations

from pathlib import Path

import dj_database_url

from gateway.env import (
    ImproperSetting,
    env_bool,
    env_float,
    env_int,
    env_list,
    env_peppers,
    env_str,
)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("GATEWAY_VAR_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DEBUG", False)
_DEV_SECRET = "insecure-dev-secret-key-change-me-0123456789abcdef"
SECRET_KEY = env_str("SECRET_KEY", _DEV_SECRET)
if not DEBUG and SECRET_KEY == _DEV_SECRET and env_bool("GATEWAY_REQUIRE_SECRETS", False):
    raise ImproperSetting("SECRET_KEY must be set when GATEWAY_REQUIRE_SECRETS is on")
if len(SECRET_KEY) < 32:
    raise ImproperSetting("SECRET_KEY must be at least 32 characters")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# API keys are stored as HMAC-SHA256(pepper, key). Versions let the pepper rotate.
API_KEY_PEPPERS = env_peppers(
    "API_KEY_PEPPERS", {1: env_str("API_KEY_PEPPER", "dev-pepper-change-me-0123456789")}
)
API_KEY_PREFIX = env_str("API_KEY_PREFIX", "igw")
if not API_KEY_PREFIX.isalnum() or not API_KEY_PREFIX.islower() or len(API_KEY_PREFIX) > 8:
    raise ImproperSetting("API_KEY_PREFIX must be 1-8 lowercase letters or digits")
# Seconds a gateway process may trust a cached credential; revocation also broadcasts.
AUTH_CACHE_SECONDS = env_float("AUTH_CACHE_SECONDS", 1.0, minimum=0.0)
# While the database is down, a principal verified this recently is still honoured (same epoch).
AUTH_STALE_SECONDS = env_float("AUTH_STALE_SECONDS", 300.0, minimum=0.0)
# Prefix-cache salts are HMAC(tenant) under this secret so tenants never share KV blocks.
CACHE_SALT_SECRET = env_str("CACHE_SALT_SECRET", SECRET_KEY)

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
    "tenants",
    "metering",
    "metering.billing",
    "workers",
    "gateway.contentlog",
    "gateway.portal",
    "gateway.api",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "gateway.dbguard.DatabaseUnavailableMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
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
# Finance exports: files land here; ranges with more rollup rows than this run as a Celery task.
MEDIA_ROOT = VAR_DIR / "media"
EXPORT_INLINE_MAX_ROWS = env_int("EXPORT_INLINE_MAX_ROWS", 5000, minimum=1)

# Request bodies: the inference API accepts large prompts, but not unbounded ones.
MAX_REQUEST_BYTES = env_int("MAX_REQUEST_BYTES", 4 * 1024 * 1024, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BYTES
# The whole body must arrive within this many seconds of the headers (else 408), so a client
# that trickles its body cannot hold a connection and a task forever (gateway.inference.bodylimit).
BODY_READ_TIMEOUT_S = env_float("BODY_READ_TIMEOUT_S", 30.0, minimum=0.1)

# Serving: the simulated engine's pool and heartbeat timing.
WORKER_HEARTBEAT_SECONDS = env_float("WORKER_HEARTBEAT_SECONDS", 1.0, minimum=0.05)
WORKER_DEAD_AFTER_SECONDS = env_float("WORKER_DEAD_AFTER_SECONDS", 5.0, minimum=0.2)
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
# Slot fairness (serving/lua/wfq/dispatch.lua, ADR 0006): a tenant that enqueued within this many
# seconds counts as active, so a worker keeps slots free for its next request; a tenant over its
# weighted share of a worker's slots may take one more only while this fraction of the slots
# (at most) stays free for the other active tenants' unused shares (0: plain work-conserving).
WFQ_ACTIVE_WINDOW_SECONDS = env_float("WFQ_ACTIVE_WINDOW_SECONDS", 5.0, minimum=0.0)
WFQ_SLOT_RESERVE = env_float("WFQ_SLOT_RESERVE", 0.5, minimum=0.0)

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
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    # Beat runs the janitor, usage flush and content-log drain every few seconds; one line per
    # task run would drown everything else at INFO.
    "loggers": {
        name: {"level": "WARNING"} for name in ("celery.app.trace", "celery.worker.strategy")
    },
}

# --- Data protection and enterprise sign-in (docs/adr/0004) ------------------------------------
# Content log master keys, newest first: "kid2:<base64 32 bytes>,kid1:<...>" (or
# CONTENT_LOG_MASTER_KEYS_FILE). Empty: a development key generated under VAR_DIR, with a warning.
CONTENT_LOG_MASTER_KEYS = env_str("CONTENT_LOG_MASTER_KEYS", "")
if not CONTENT_LOG_MASTER_KEYS and env_bool("GATEWAY_REQUIRE_SECRETS", False):
    raise ImproperSetting("CONTENT_LOG_MASTER_KEYS must be set when GATEWAY_REQUIRE_SECRETS is on")
CONTENT_LOG_MAX_RETENTION_DAYS = 30  # the policy's ceiling, not a knob
CONTENT_LOG_MAX_PENDING = env_int("CONTENT_LOG_MAX_PENDING", 100_000, minimum=1)
# Break-glass: self-approval (with an alert to ADMINS) only if explicitly allowed.
BREAKGLASS_SELF_APPROVAL = env_bool("BREAKGLASS_SELF_APPROVAL", False)
BREAKGLASS_MAX_MINUTES = env_int("BREAKGLASS_MAX_MINUTES", 8 * 60, minimum=1)
ADMINS = [("Platform", a) for a in env_list("ADMIN_EMAILS", [])]
# OIDC bearer tokens (tenants.oidc): clock skew allowed on exp/nbf, JWKS caching.
OIDC_LEEWAY_SECONDS = env_int("OIDC_LEEWAY_SECONDS", 30, minimum=0)
OIDC_JWKS_CACHE_SECONDS = env_int("OIDC_JWKS_CACHE_SECONDS", 300, minimum=1)
OIDC_JWKS_MIN_REFRESH_SECONDS = env_float("OIDC_JWKS_MIN_REFRESH_SECONDS", 30.0, minimum=0.0)
OIDC_HTTP_TIMEOUT_SECONDS = env_float("OIDC_HTTP_TIMEOUT_SECONDS", 3.0, minimum=0.1)
# Mutual TLS behind a TLS-terminating proxy (tenants.mtls): the certificate headers are read
# only from peers in TRUSTED_PROXY_CIDRS; from anyone else they are ignored.
TRUSTED_PROXY_CIDRS = env_list("TRUSTED_PROXY_CIDRS", [])
for _cidr in TRUSTED_PROXY_CIDRS:
    try:
        __import__("ipaddress").ip_network(_cidr, strict=False)
    except ValueError:
        raise ImproperSetting(f"TRUSTED_PROXY_CIDRS: {_cidr!r} is not a CIDR") from None
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
AXES_LOCKOUT_TEMPLATE = "portal/locked_out.html"
AXES_VERBOSE = False
