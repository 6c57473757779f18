"""unionsparse.compressor.evaluate"""
