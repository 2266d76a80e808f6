"""The framework-free core: snapshots, slots, the saver, storage, commit and retention.

Public names are re-exported from the package root; import submodules for the rest.
"""
