# NCTV web app as a Docker Space (https://huggingface.co/docs/hub/spaces-sdks-docker).
# Build: docker build -t nctv .      Run: docker run -p 7860:7860 nctv      Open: http://localhost:7860
FROM python:3.11-slim

# CPU wheels of PyTorch keep the image small. On GPU hardware, build with
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124
# (a Space passes its variables of the same name as build arguments).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Spaces run the container as uid 1000; everything the app writes lives under its home.
RUN useradd --create-home --uid 1000 user
USER user
ENV HOME=/home/user \
    PATH=/home/user/.local/bin:$PATH \
    GRADIO_SERVER_NAME=0.0.0.0 \
    PORT=7860 \
    MPLCONFIGDIR=/home/user/.cache/matplotlib \
    NCTV_CACHE_DIR=/home/user/.cache/nctv
WORKDIR /home/user/app

# Dependencies first, so editing the code does not reinstall PyTorch.
COPY --chown=user pyproject.toml README.md constraints.txt ./
COPY --chown=user nctv/__init__.py nctv/__init__.py
# constraints.txt pins the versions the tests passed with.
RUN pip install --user --extra-index-url "$TORCH_INDEX_URL" -c constraints.txt torch torchvision \
 && pip install --user --extra-index-url "$TORCH_INDEX_URL" -c constraints.txt .

COPY --chown=user . .
RUN pip install --user --no-deps --force-reinstall .

EXPOSE 7860
CMD ["python", "app.py"]
