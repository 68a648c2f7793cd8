"""kernelgen's version, in a module of its own so that the runtime's cache can key on it without importing the
package's API (kernelgen/__init__.py re-exports it)."""
__version__ = "0.1.0"
