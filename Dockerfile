# lbproxy in a container: `docker build -t lbproxy .` then
#   docker run --rm -p 8080:8080 -p 9100:9100 lbproxy
# runs configs/container/ (copied to /etc/lbproxy): the virtual server `web` on port 8080
# and the admin endpoint (dashboard at /, /metrics, /healthz, /readyz, /api/v1) on 9100,
# both on 0.0.0.0 so they are reachable from outside the container. Mount your own
# folder to replace it: -v $PWD/my-lbproxy:/etc/lbproxy:ro. Every *.yaml in /etc/lbproxy
# is a virtual-server file (one may hold `global:`). Kubernetes: contrib/kubernetes/.
#
# Two stages: the first has gcc and builds the wheel with the compiled connection path
# (lbproxy/net/_cpump.c, issue 26; the slim image has the Python headers already); the
# image itself gets only the wheel, no compiler. `lbproxy --version` in the container
# says "connection path: compiled".
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY lbproxy ./lbproxy
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim

RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin lbproxy

COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/lbproxy-*.whl && rm -rf /wheels
COPY configs/container/ /etc/lbproxy/

USER lbproxy
WORKDIR /
# The admin socket's folder (lbproxy makes /tmp/lbproxy/, 0700): `docker exec` and
# `kubectl exec ... lbproxy drain web a` change the proxy through it with no token; over
# TCP without a token_file the admin endpoint is read-only.
ENV XDG_RUNTIME_DIR=/tmp
# The ports of configs/container/: web.yaml's listener and global.yaml's admin.listen.
EXPOSE 8080 9100
# SIGTERM drains connections for global.drain_timeout (30s), then exits 0: stop with
# more grace than that (`docker stop -t 40`, compose's stop_grace_period: 40s).
STOPSIGNAL SIGTERM
# /healthz on the admin endpoint; 0.0.0.0:9100 answers on the container's loopback too.
# Set LBPROXY_ADMIN if you move it. The slim image has no curl: Python's urllib does it.
ENV LBPROXY_ADMIN=http://127.0.0.1:9100
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['LBPROXY_ADMIN'] + '/healthz', timeout=2)"]
ENTRYPOINT ["lbproxy"]
CMD ["run", "/etc/lbproxy"]
