"""Model specs: `smollm2`, tiny random test models, local folders, `.gguf` files and hub ids."""

from workbench.models.loader import LoadedModel, load_model, resolve_folder

__all__ = ["LoadedModel", "load_model", "resolve_folder"]
