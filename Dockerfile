# memproxy: an OpenAI-compatible proxy with long-term memory.
# The embedding model is not downloaded at run time: mount it and point
# MEMPROXY_EMBEDDING_MODEL_DIR at it (or let chromadb's cache path hold it).
FROM python:3.11-slim

# Bound to 0.0.0.0: with MEMPROXY_UPSTREAM_API_KEY set, also set MEMPROXY_API_KEYS (or
# MEMPROXY_OPEN_RELAY=on, if anyone who reaches the port may spend that key): serve refuses
# to start an open relay (docs/security.md).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    MEMPROXY_HOST=0.0.0.0 \
    MEMPROXY_PORT=8080 \
    MEMPROXY_DATA_DIR=/data
# Two malloc arenas: the embedding threads' own arenas are what grows (proxy/http/serving.py).
ENV MALLOC_ARENA_MAX=2

WORKDIR /app
COPY pyproject.toml README.md ./
COPY config ./config
COPY memory ./memory
COPY proxy ./proxy
RUN pip install --no-cache-dir . && useradd --create-home memproxy && mkdir -p /data \
    && chown memproxy /data

USER memproxy
VOLUME ["/data"]
EXPOSE 8080
HEALTHCHECK CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz')"
CMD ["memproxy", "serve"]
