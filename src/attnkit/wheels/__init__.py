"""The wheel pipeline: recipe (what to build), toolkit (with what nvcc), build (driver), retag (name and pin),
verify (archs, import, pin, auditwheel, sha256), index (PEP 503 + find-links), resolve (wheel-url, install)."""
