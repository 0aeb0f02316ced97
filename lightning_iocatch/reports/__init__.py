"""Reports a person looks at: files written from results and stores, no Lightning.

Imported by the command line only (and by you): the Lightning adapter never imports it.
"""

from lightning_iocatch.reports.browser import write_browser

__all__ = ["write_browser"]
