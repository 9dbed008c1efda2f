{{/* Environment every job gets: S3 endpoint and credentials (none with `.noS3`), the Pushgateway, the lease
     owner (the release), caches on /scratch (or the shared model cache), then the job's extraEnv. `.index`
     true: SAPD_METRICS_INSTANCE is the pod's completion index (a Pushgateway grouping key per worker).
     The root filesystem is read-only (securityContext.container.readOnlyRootFilesystem): every cache and
     config the libraries write goes to the scratch volume — HOME, torch extensions, vLLM's caches and
     config, numba (XDG_CACHE_HOME, XDG_CONFIG_HOME), triton's kernels, matplotlib's config — and
     temporary files to /tmp (an emptyDir; the image's TMPDIR default). */}}
{{- define "sapd.env" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
- name: SAPD_S3_ENDPOINT_URL
  value: {{ .root.Values.s3.endpoint | quote }}
- name: AWS_DEFAULT_REGION
  value: {{ .root.Values.s3.region | quote }}
{{- if not (or .root.Values.s3.useServiceAccount .noS3) }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.s3.secretName }}
      key: {{ .root.Values.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.s3.secretName }}
      key: {{ .root.Values.s3.secretAccessKeyKey }}
{{- end }}
- name: SAPD_PUSHGATEWAY_URL
  value: {{ .root.Values.pushgateway.url | quote }}
- name: SAPD_JOB
  value: {{ .component }}
{{- $limits := dict }}
{{- if and .job .job.resources .job.resources.limits }}{{ $limits = .job.resources.limits }}{{ end }}
{{- $gpus := index $limits "nvidia.com/gpu" | default 0 | int }}
{{- if gt $gpus 0 }}
# the GPUs this container was given: model.device auto stops rather than fall back to the CPU when torch sees none
- name: SAPD_POD_GPUS
  value: {{ $gpus | quote }}
{{- end }}
# the training ranks (train pods × processes per pod): what the checks size ZeRO's shards by and divide a
# minibatch's micro-batches over, in the driver and the preflight pod too
- name: SAPD_TRAIN_PROCESSES
  value: {{ mul (int .root.Values.train.parallelism) (int .root.Values.train.procsPerPod) | quote }}
- name: SAPD_RELEASE
  value: {{ .root.Release.Name | quote }}
{{- /* every pod of the release claims the run root's lease as the release: the driver, its successor after a
     restart or an upgrade, the gates and the stage Jobs share it; another release on the root is refused */}}
- name: SAPD_LEASE_OWNER
  value: {{ printf "release %s in namespace %s" .root.Release.Name .root.Release.Namespace | quote }}
- name: SAPD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- if .index }}
- name: SAPD_METRICS_INSTANCE
  valueFrom:
    fieldRef:
      fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
{{- end }}
- name: HOME
  value: /scratch/home
- name: XDG_CACHE_HOME
  value: /scratch/cache
- name: XDG_CONFIG_HOME
  value: /scratch/config
- name: TRITON_CACHE_DIR
  value: /scratch/cache/triton
- name: MPLCONFIGDIR
  value: /scratch/config/matplotlib
{{- if .root.Values.modelCache.type }}
- name: SAPD_CACHE_DIR
  value: {{ printf "%s/sapd" .root.Values.modelCache.mountPath | quote }}
- name: HF_HOME
  value: {{ printf "%s/hf" .root.Values.modelCache.mountPath | quote }}
{{- else }}
- name: HF_HOME
  value: /scratch/hf
{{- end }}
- name: SAPD_TEXTWORLD_CACHE
  value: {{ ternary (printf "%s/textworld" .root.Values.modelCache.mountPath) "/scratch/textworld" (ne .root.Values.modelCache.type "") | quote }}
- name: PYTHONUNBUFFERED
  value: "1"
{{- /* torch's CPU threads (OpenMP): one per core of the container's CPU limit (rounded up; the node's cores
     without a limit), not torch's default of one per core of the node, which oversubscribes a pod limited
     to fewer. Not with `.manyProcesses` (a train pod of several ranks): torchrun gives each one thread. */}}
{{- if not .manyProcesses }}
- name: OMP_NUM_THREADS
  valueFrom:
    resourceFieldRef:
      resource: limits.cpu
      divisor: "1"
{{- end }}
{{- if and .webshop .root.Values.evaluate.webshop.url }}
- name: SAPD_WEBSHOP_URL
  value: {{ .root.Values.evaluate.webshop.url | quote }}
{{- end }}
{{- with .env }}
{{ toYaml . }}
{{- end }}
{{- /* values as strings: `--set extraEnv[0].value=1` gives a number, which a pod spec refuses */}}
{{- $extra := list }}
{{- range $s.extraEnv }}
{{- $e := deepCopy . }}
{{- if hasKey $e "value" }}{{ $_ := set $e "value" (toString $e.value) }}{{ end }}
{{- $extra = append $extra $e }}
{{- end }}
{{- with $extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}
