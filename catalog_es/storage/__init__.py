"""The log's storage beneath :mod:`catalog_es.persistence` (its recorder)."""
