"""unionsparse.compressor.pipeline"""
