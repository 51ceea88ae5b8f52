# CPU image for the API, control worker, beat and migrations (and CPU model workers).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY api ./api
COPY core ./core
COPY engine ./engine
COPY worker ./worker
COPY cli ./cli
COPY migrations ./migrations
ARG TORCH_INDEX=""
RUN if [ -n "$TORCH_INDEX" ]; then pip install --index-url "$TORCH_INDEX" torch==2.13.0; fi && pip install .
RUN useradd --create-home batchd
USER batchd
EXPOSE 8000
CMD ["uvicorn", "api.app:app", "--host", "0.0.0.0", "--port", "8000"]
