"""unionsparse.compressor.model"""
