# Before the read sides import the event library: catalog_es hides from it
# what of the environment it must not take (its own __init__).
import catalog_es  # noqa: F401
