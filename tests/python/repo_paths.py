"""Where every test finds the repository, the microspec binary (MICROSPEC_BIN, else build/microspec),
the two real models that scripts/setup.sh fetches and llama.cpp's chat templates."""
import os
import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("MICROSPEC_BIN", str(REPO / "build" / "microspec"))
MODELS = {
    "gemma": REPO / "models" / "gemma-3-270m-q4_k_m.gguf",
    "smollm2": REPO / "models" / "smollm2-135m-instruct-q4_1.gguf",
}


def llama_cpp_templates():
    """llama.cpp's models/templates/ in the llama-cpp-python sdist (fetched by the setup; the script
    prints where it is)."""
    out = subprocess.run(["bash", str(REPO / "scripts" / "fetch_llama_cpp_sdist.sh")], check=True,
                         capture_output=True, text=True)
    return pathlib.Path(out.stdout.strip()) / "models" / "templates"
