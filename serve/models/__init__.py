"""pdserve.serve.models"""
