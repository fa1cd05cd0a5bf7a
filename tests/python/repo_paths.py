"""Where every test finds the repository, the microspec binary (MICROSPEC_BIN, else build/microspec)
and the two real models that scripts/setup.sh fetches."""
import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("MICROSPEC_BIN", str(REPO / "build" / "microspec"))
MODELS = {
    "gemma": REPO / "models" / "gemma-3-270m-q4_k_m.gguf",
    "smollm2": REPO / "models" / "smollm2-135m-instruct-q4_1.gguf",
}
