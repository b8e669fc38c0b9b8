#!/usr/bin/env python3
"""Fulfils one request through the fulfilment page in a real headless Chromium.

Used by tests/e2e/tests/fulfilment.rs: opens the link from a received mail, screenshots the
request page, fills the form by its accessible labels, submits, screenshots the result, opens the
link again (already fulfilled) and, with --refused, an altered link. Prints one JSON object with
what each page said, for the test to check.
"""

import argparse
import json
import sys

from playwright.sync_api import sync_playwright


def state(page, response):
    return {
        "status": response.status if response else None,
        "title": page.title(),
        "h1": page.locator("h1").inner_text(),
        "text": page.locator("main").inner_text(),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--chromium", required=True)
    parser.add_argument("--link", required=True)
    parser.add_argument("--screenshots", required=True, help="directory")
    parser.add_argument("--prefix", required=True)
    parser.add_argument(
        "--fill", action="append", default=[], help="LABEL=VALUE, filled by label"
    )
    parser.add_argument(
        "--select", action="append", default=[], help="ID=OPTION, a select by id"
    )
    parser.add_argument("--refused", help="an altered link to open last")
    parser.add_argument(
        "--map-host",
        help="HOST=ADDRESS:PORT: the browser reaches HOST there (a proxy in front of the page)",
    )
    parser.add_argument(
        "--ignore-https-errors",
        action="store_true",
        help="accept the proxy's test certificate (Chromium trusts an NSS database, not a file)",
    )
    args = parser.parse_args()

    out = {}
    with sync_playwright() as p:
        flags = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        if args.map_host:
            host, target = args.map_host.split("=", 1)
            flags.append(f"--host-resolver-rules=MAP {host} {target}")
        browser = p.chromium.launch(
            executable_path=args.chromium, headless=True, args=flags
        )
        page = browser.new_page(
            viewport={"width": 900, "height": 600},
            ignore_https_errors=args.ignore_https_errors,
        )
        shot = lambda name: page.screenshot(
            path=f"{args.screenshots}/{name}.png", full_page=True
        )

        response = page.goto(args.link)
        out["request"] = state(page, response)
        out["scripts"] = page.locator("script").count()
        shot(f"{args.prefix}-request")

        for item in args.fill:
            label, value = item.split("=", 1)
            page.get_by_label(label, exact=True).first.fill(value)
        for item in args.select:
            ident, option = item.split("=", 1)
            page.locator(f"#{ident}").select_option(option)
        with page.expect_navigation():
            page.get_by_role("button", name="Record it").click()
        out["submitted"] = state(page, None)
        shot(f"{args.prefix}-success")

        response = page.goto(args.link)
        out["again"] = state(page, response)
        shot(f"{args.prefix}-already-fulfilled")

        if args.refused:
            response = page.goto(args.refused)
            out["refused"] = state(page, response)
            shot("refused")
        browser.close()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
