{{/*
The operator's RBAC rules, in two parts: those on namespaced resources
(bound cluster-wide, or with watchNamespace only in that namespace) and
those on cluster-scoped ones (always a ClusterRole). Each rule says why.
*/}}
{{- define "model-residency.namespacedRules" }}
  # Read the GPUs' budgets, registries and demand: the controller lists and
  # watches ModelResidency objects (and lists one at start-up as a check),
  # and reads the one a ModelDemand names.
  - apiGroups: ["residency.dev"]
    resources: ["modelresidencies"]
    verbs: ["get", "list", "watch"]
  # The ModelCatalogs residencies name (a residency's registry is its
  # catalog's entries and its own), and their status (the model count).
  - apiGroups: ["residency.dev"]
    resources: ["modelcatalogs"]
    verbs: ["list", "watch"]
  - apiGroups: ["residency.dev"]
    resources: ["modelcatalogs/status"]
    verbs: ["patch"]
  # ResidencySets: one ModelResidency stamped per GPU a set selects, made
  # and updated by server-side apply (a patch) and deleted once drained
  # when its GPU leaves; the set's own status.
  - apiGroups: ["residency.dev"]
    resources: ["residencysets"]
    verbs: ["list", "watch"]
  - apiGroups: ["residency.dev"]
    resources: ["residencysets/status"]
    verbs: ["patch"]
  - apiGroups: ["residency.dev"]
    resources: ["modelresidencies"]
    verbs: ["create", "delete"]
  # Write decisions into status (server-side apply is a patch). The only
  # spec write is a ModelDemand's demand key (one merge patch of
  # spec.demand.<model>), hence patch on modelresidencies, never update or
  # delete.
  - apiGroups: ["residency.dev"]
    resources: ["modelresidencies/status"]
    verbs: ["patch"]
  - apiGroups: ["residency.dev"]
    resources: ["modelresidencies"]
    verbs: ["patch"]
  # ModelDemand objects (opt-in, for HPA/KEDA/kubectl scale): watched,
  # given a finalizer (a patch) so that deleting one removes its demand key,
  # and their status (the model's state, /scale's replicas) written.
  - apiGroups: ["residency.dev"]
    resources: ["modeldemands"]
    verbs: ["list", "watch", "patch"]
  - apiGroups: ["residency.dev"]
    resources: ["modeldemands/status"]
    verbs: ["patch"]
  # ModelCopies objects (opt-in, for HPA/KEDA/kubectl scale over a model's
  # copies): listed each copy-scaler tick, their status (Ready copies, the
  # selector for /scale) written.
  - apiGroups: ["residency.dev"]
    resources: ["modelcopies"]
    verbs: ["list"]
  - apiGroups: ["residency.dev"]
    resources: ["modelcopies/status"]
    verbs: ["patch"]
  {{- if .Values.anticipation.persistForecasts }}
  # The forecasts of residencies with spec.anticipate on, one ConfigMap
  # beside each (--persist-forecasts): read once, applied.
  - apiGroups: [""]
    resources: ["configmaps"]
    verbs: ["get", "create", "patch"]
  {{- end }}
  {{- if .Values.inferencePools.enabled }}
  # One InferencePool per model (--inference-pools): listed, applied
  # (server-side), deleted when no residency lists its model.
  - apiGroups: ["inference.networking.k8s.io"]
    resources: ["inferencepools"]
    verbs: ["list", "create", "patch", "delete"]
  {{- if .Values.inferencePools.llmdAdapterMaps }}
  # One ConfigMap per base model with adapters for llm-d's payload
  # processor (--llm-d-adapter-maps): listed by its label, read (one of
  # that name the operator did not make is left alone), applied, deleted.
  - apiGroups: [""]
    resources: ["configmaps"]
    verbs: ["list", "get", "create", "patch", "delete"]
  {{- end }}
  {{- if .Values.inferencePools.gatewayRoutes.enabled }}
  # One HTTPRoute per serving model and the router's catch-all
  # (--gateway-routes): listed, read, applied, deleted when a model stops
  # serving.
  - apiGroups: ["gateway.networking.k8s.io"]
    resources: ["httproutes"]
    verbs: ["list", "get", "create", "patch", "delete"]
  {{- end }}
  {{- end }}
  # One model pod per resident model: created on load, deleted on eviction
  # or unload, listed and watched (by label) to see it become Ready, fail
  # or go. In claim mode (spec.gpu) also one GPU holder pod per residency,
  # read (get) to see whether it is there and what the scheduler says of
  # it.
  - apiGroups: [""]
    resources: ["pods"]
    # patch: the copy scaler's draining label on a copy being removed.
    verbs: ["get", "list", "watch", "create", "delete", "patch"]
  # Claim mode: one ResourceClaim per residency, created when missing,
  # deleted when spec.device changes (a claim's spec cannot), watched (list
  # and watch) for its allocation and its consumers, read (get) by name.
  - apiGroups: ["resource.k8s.io"]
    resources: ["resourceclaims"]
    verbs: ["get", "list", "watch", "create", "delete"]
  # Loaded / Evicted / Refused / Unloaded / LoadFailed / InvalidSpec events.
  # Each is a new event (the operator keeps no series cache, so it never
  # patches one).
  - apiGroups: ["events.k8s.io"]
    resources: ["events"]
    verbs: ["create"]
{{- end }}

{{- define "model-residency.clusterRules" }}
  # The nodes' labels, for a ResidencySet's nodeSelector (metadata only),
  # and which are cordoned (a field-selected watch: no new models there).
  - apiGroups: [""]
    resources: ["nodes"]
    verbs: ["list", "watch"]
  # The nodes' artifact caches (written by the node agents): a model with
  # an artifact starts once its node's cache holds it.
  - apiGroups: ["residency.dev"]
    resources: ["nodemodelcaches"]
    verbs: ["list", "watch"]
  # The devices the DRA drivers publish: the allocated device's uuid and
  # memory (status.gpu, and the budget when spec.budget is omitted), and
  # `model-residency gpus`.
  - apiGroups: ["resource.k8s.io"]
    resources: ["resourceslices"]
    verbs: ["get", "list", "watch"]
  # Whether a claim's DeviceClass exists, to say so when it does not.
  - apiGroups: ["resource.k8s.io"]
    resources: ["deviceclasses"]
    verbs: ["get", "list", "watch"]
{{- end }}
