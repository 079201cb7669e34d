"""Protocol health checks as sans-io exchanges (SPEC §22): bytes in, bytes to send and a
verdict out; no trio, no sockets, no clock. exchange.py says the interface; one module
per protocol (pgsql, mysql, redis, smtp, send_expect's binary form). The one runner that
drives them over a connected stream, owns the answer bound and the timeout, is
lbproxy/control/checks.py."""
