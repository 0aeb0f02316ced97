"""Reports a person looks at: files written from results and stores, no Lightning.

Imported by the command line only (and by you): the Lightning adapter never imports it.
"""

from lightning_iocatch.reports.browser import write_browser
from lightning_iocatch.reports.store_units import summarize_store

__all__ = ["summarize_store", "write_browser"]
