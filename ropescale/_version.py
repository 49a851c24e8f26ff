"""The package version, in a leaf module: what records it (run manifests) need not import the package face."""

__version__ = "0.1.0"
