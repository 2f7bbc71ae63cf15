"""Model loading, and the small models the project makes and ships."""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).with_name("default")


def default_model_path() -> Path:
    """The embedded model that ships in the package; the default everywhere."""
    return DEFAULT_MODEL_DIR
