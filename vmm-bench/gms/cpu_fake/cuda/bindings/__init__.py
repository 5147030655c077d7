# See driver.py.
