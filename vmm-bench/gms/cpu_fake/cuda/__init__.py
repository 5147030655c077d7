# A stand-in for cuda.bindings on machines without a GPU: compare.py --cpu only (see driver.py).
