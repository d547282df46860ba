# One image for the API and the worker (the worker needs the toolchains it offers).
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 gcc g++ default-jdk-headless nodejs ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY api api
COPY worker worker
COPY shared shared
COPY launcher launcher
COPY sandbox-profiles sandbox-profiles
COPY web web
RUN pip install --no-cache-dir -e .
ENV SANDBOX_PROFILES_DIR=/app/sandbox-profiles
CMD ["coderunner", "api", "--host", "0.0.0.0"]
