"""unionsparse.solvers"""
