# The provider's container image (what the chart's Deployment runs). Not built in CI: the
# development machines have no container engine. Build: docker build -t <repo>:<tag> .
FROM docker.io/library/rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p cluster-api-provider-mailgun --bin cluster-api-provider-mailgun

# glibc + CA certificates, no shell, non-root (the chart's securityContext expects 65532).
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/cluster-api-provider-mailgun /manager
USER 65532:65532
ENTRYPOINT ["/manager"]
