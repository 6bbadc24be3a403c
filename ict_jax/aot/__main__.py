"""`python -m ict_jax.aot`."""

from ict_jax.aot import main

if __name__ == "__main__":
  main()
