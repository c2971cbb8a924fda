"""Default limits of the HTTP server (the `serve` options, create_app and the uvicorn config).

Kept free of FastAPI/uvicorn imports so that the CLI can declare its options cheaply.
"""

DEFAULT_MAX_BODY_BYTES = 1 << 20     # largest request body (413 above)
DEFAULT_CHAT_MAX_TOKENS = 256        # max_tokens of a chat request that gives none
DEFAULT_BODY_TIMEOUT = 30.0          # seconds for a whole request body to arrive (408 after)
DEFAULT_HEADER_TIMEOUT = 10.0        # seconds for complete request headers (connection closed after)
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0     # seconds an idle keep-alive connection stays open
DEFAULT_MAX_CONNECTIONS = 2048       # open connections or running requests; 503 beyond
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 256  # open connections of one client key (clients.py); 429 beyond
DEFAULT_UNPROVEN_CONNECTION_RATE = 16.0  # new connections per second of a client whose connections
                                         # carry no successful request, once it has that many unproven
DEFAULT_METRICS_INTERVAL = 1.0       # seconds: /metrics serves a snapshot at most this old
DEFAULT_PROBE_RATE = 20.0           # /health + /metrics requests per second one client may send (burst 5x)
PROBE_MAX_WAIT = 1.0                # seconds a probe past that rate waits for its turn; 429 beyond
DEFAULT_SHUTDOWN_GRACE = 10.0        # seconds running requests get to finish on SIGINT/SIGTERM
EVENT_LOOPS = ("auto", "asyncio", "uvloop")  # --event-loop; auto: uvloop when installed
MAX_HEADER_BYTES = 16 * 1024         # request line + headers (400 and close above)
