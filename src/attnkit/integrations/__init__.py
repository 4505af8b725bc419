"""Adapters that put attnkit.attention() where models already call attention. Each imports its framework
lazily: `import attnkit` never imports transformers."""
