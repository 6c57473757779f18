"""unionsparse.kernels"""
