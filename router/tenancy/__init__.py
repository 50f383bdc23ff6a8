"""Tenancy: who is calling (client API keys mapped to tenants, ``client_keys``; the request
path's check and the engines' own credentials, ``client_auth``) and what each tenant may do.

May import: no other room (the settings, errors and registry's file reader only).
"""
