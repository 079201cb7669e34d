# lbproxy in a container: `docker build -t lbproxy .` then
#   docker run --rm -p 8080:8080 -v $PWD/configs:/etc/lbproxy:ro lbproxy
# Every *.yaml in /etc/lbproxy is a virtual-server file (one may hold `global:`).
FROM python:3.11-slim

RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin lbproxy

WORKDIR /src
COPY pyproject.toml README.md ./
COPY lbproxy ./lbproxy
RUN pip install --no-cache-dir . && rm -rf /src

USER lbproxy
WORKDIR /
# SIGTERM drains connections for global.drain_timeout, then exits 0.
STOPSIGNAL SIGTERM
# /healthz on the admin endpoint (global.admin.listen, 127.0.0.1:9100 by default; set
# LBPROXY_ADMIN if you move it). The slim image has no curl: Python's urllib does it.
ENV LBPROXY_ADMIN=http://127.0.0.1:9100
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['LBPROXY_ADMIN'] + '/healthz', timeout=2)"]
ENTRYPOINT ["lbproxy"]
CMD ["run", "/etc/lbproxy"]
