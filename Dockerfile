# syntax=docker/dockerfile:1
# model-residency operator image.
#
#   DOCKER_BUILDKIT=1 docker build -t model-residency:0.1.0 .
#
# Build stage: a release binary without the `local` feature (the test
# control plane and kubelet stand-in stay out of the image). BuildKit cache
# mounts keep the crate registry and the target directory between builds,
# so a source edit recompiles only this crate; nothing here lists the
# project's targets, so adding one cannot break the image build.
# tests/dockerfile.rs runs these steps on exactly what the COPY lines bring.
# The runtime stage is distroless (no shell, no package manager) and runs as
# the non-root user 65532, matching the chart's securityContext
# (runAsNonRoot, readOnlyRootFilesystem).
FROM rust:1.95-bookworm AS build
WORKDIR /src
ENV CARGO_BUILD_JOBS=2
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY benches ./benches
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --no-default-features --bin model-residency \
    && cp target/release/model-residency /model-residency

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /model-residency /usr/local/bin/model-residency
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/model-residency"]
CMD ["run", "--log-format=json"]
