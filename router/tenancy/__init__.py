"""Tenancy: who is calling (client API keys mapped to tenants, ``client_keys``; the request
path's check and the engines' own credentials, ``client_auth``) and what each tenant may use:
requests and tokens per minute and requests in flight, enforced with the ``limits`` library
(``limiter``, ``windows``), reported in the ``x-ratelimit-*`` headers OpenAI clients know
(``headers``).

May import: no other room (the top level: settings, errors, registry's file reader).
"""
