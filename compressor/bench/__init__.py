"""unionsparse.compressor.bench"""
