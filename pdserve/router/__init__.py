"""pdserve.router"""
