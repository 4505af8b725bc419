"""Images per cell: the hermetic wheelhouse (wheelhouse) and the builder (build: docker buildx or podman)."""
