"""Native CPU kernels: C++ sources (csrc/, one file per GGUF block family) compiled on first use
for the machine's CPU (build.py) and registered as torch ops (native.py). Models import this
package; it imports nothing of the models."""
