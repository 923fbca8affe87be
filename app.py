"""Start the NCTV web app: python app.py  (host $GRADIO_SERVER_NAME, default 0.0.0.0; port $PORT, default 7860)."""
from nctv.ui import launch

if __name__ == "__main__":
    launch()
